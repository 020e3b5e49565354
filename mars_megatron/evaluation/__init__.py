"""Evaluation of the V–C reasoning system: ``mars eval`` (MARSRL.md §1).

``data`` reads problems, ``runner`` drives many inference loops on one engine, ``metrics`` computes
accuracies and pass@k, ``results`` owns the output directory and ``command`` wires them to the CLI.
"""
