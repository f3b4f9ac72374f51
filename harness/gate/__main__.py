"""`python -m harness.gate ...`: see harness/gate/cli.py and docs/gate.md."""

from harness.gate.cli import main

raise SystemExit(main())
