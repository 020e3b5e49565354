"""Evaluation of an agent graph's inference loop: ``mars eval`` (MARSRL.md §1 for the default graph).

``data`` reads problems, ``runner`` drives many inference loops on the engines of the graph's roles,
``metrics`` computes accuracies and pass@k, ``results`` owns the output directory and ``command`` wires
them to the CLI.
"""
