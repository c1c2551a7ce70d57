"""The quality studies of STUDY.md: what they measure on held-out text (``heldout``) and the servable study's
design and tables (``servable``); the scripts that run them are in ``benchmarks/``, their results in ``study/``. Research tooling of the repository, not part of the installed package."""
