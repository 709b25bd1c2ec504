"""Standard benchmarks (``minicpm4 eval bench``): MMLU, CMMLU, C-Eval, ARC, GSM8K, MATH-500, BBH,
HumanEval, MBPP from local files; see :mod:`.run` for the entry points."""
