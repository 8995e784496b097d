"""Every benchmark, shipped with the package (``pip install dtlab[bench]`` adds what the plots need).

Each is a module with a command line: ``python -m dtlab.benchmarks.<name> --help``. ``dtlab bench``
runs ``strategies``, ``compression`` and ``mesh`` and writes their tables and plots; the others
(``collectives``, ``tensor``, ``pipeline``, ``convergence``, ``elastic``, ...) are run on their own, as
``docs/`` describes next to their results.
"""
