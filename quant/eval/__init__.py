"""Evaluation of the exported checkpoint: proxies, streamed proxies, lm-eval, HumanEval and its sandbox."""
