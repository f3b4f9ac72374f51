# Sourced by .ci/run: the summary of CI's timed phases, and the budget warning (tests/test_ci_budget.py).
#   ci_summary TOTAL_S BUDGET_S TEST_LOG "SECONDS NAME" ...
# prints one line with every phase and the total; when TOTAL_S > BUDGET_S, one more line: the warning, naming the
# three slowest phases and the three slowest tests of pytest's `--durations` lines in TEST_LOG.
# .ci/run calls it from its EXIT trap under `set -euo pipefail`: no `head` after a long pipe (once sort's output
# outgrew what head read, sort died of SIGPIPE, pipefail made that the trap's exit code, 141, and CI failed over
# budget instead of warning); awk 'NR <= 3' reads everything. A log with no duration line (a collection error, a
# setup that failed before pytest ran) makes grep exit 1: `|| true`, or pipefail and set -e end the trap there.
ci_fmt() { printf '%d:%02d' $(($1 / 60)) $(($1 % 60)); }

ci_summary() {
  local total=$1 budget=$2 log=$3; shift 3
  echo "ci: phases: ${*:-none} | total $(ci_fmt "$total") (budget $(ci_fmt "$budget"))"
  [ "$total" -gt "$budget" ] || return 0
  local phases tests
  phases=$(printf '%s\n' "$@" | sort -rn | awk 'NR <= 3 {printf "%s%s %ss", sep, $2, $1; sep=", "}')
  tests=$({ grep -E '^[0-9.]+s (call|setup|teardown) ' "$log" 2>/dev/null || true; } | sort -rn | awk 'NR <= 3' \
          | sed -E 's/^([0-9.]+s) +[a-z]+ +(.{1,100}).*$/\2 \1/' | paste -sd ';' - | sed 's/;/; /g')
  echo "ci: warning: $(ci_fmt "$total") is over the $(ci_fmt "$budget") budget; slowest phases: $phases; slowest tests: ${tests:-n/a}"
}
