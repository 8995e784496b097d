"""The benchmarks ``dtlab bench`` runs, shipped with the package (``pip install dtlab[bench]``).

Each is a module with a command line: ``python -m dtlab.benchmarks.strategies --help`` and
``python -m dtlab.benchmarks.compression --help``.
"""
