"""Fixed prompt sets, written for the project. A benchmark is only comparable on the same prompts.

`default` mixes lengths (short question to a paragraph) so TTFT and decode are both exercised.
`edit` is input-grounded (the answer copies spans of the prompt): where prompt-lookup drafting shines.
"""

from __future__ import annotations

PROMPT_SETS: dict[str, list[str]] = {
    "default": [
        "What is the capital of France?",
        "Explain in two sentences why the sky looks blue during the day.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle. "
        "Keep it under one hundred words and give it a hopeful ending.",
        "Summarize the following note for a busy manager: The build server ran out of disk space on "
        "Tuesday night, so the nightly tests did not run. On Wednesday morning the team cleared old "
        "artifacts, added an alert at eighty percent usage, and re-ran the tests, which all passed. "
        "No release was delayed.",
    ],
    "edit": [
        "Rename the variable `count` to `total` in this function and return the full function:\n"
        "def add_all(values):\n    count = 0\n    for v in values:\n        count += v\n    return count\n",
        "Fix the spelling mistakes and repeat the paragraph: The quick brown fox jumpd over the lazy dog. "
        "It was a sunny day and the fox was verry happy. The dog did not mind at all.",
        "Convert this list to a numbered list and keep every item: - flour - sugar - eggs - butter - milk",
        "Add type hints to this function and return the full function:\n"
        "def greet(name, times):\n    for _ in range(times):\n        print('Hello, ' + name)\n",
    ],
}
