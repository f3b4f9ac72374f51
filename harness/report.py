"""`python -m harness.report`: the documented entry point of harness/records/report.py."""

from harness.records.report import main

if __name__ == "__main__":
    raise SystemExit(main())
