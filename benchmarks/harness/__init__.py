"""What the ``bench_*.py`` scripts share: the command line (``cli``), the models and their
checkpoints (``spec``, ``files``, ``fsdp``, ``layouts``), the launcher of real gloo ranks
(``launch``, ``ranks``), the loaders measured and how (``loaders``, ``measure``, ``phases``,
``common``, ``throttle``, ``s3``), and the report of a full run (``report``, ``goals``,
``attrib``, ``load_tables``, ``stats``, ``plot``).

A script run as ``python benchmarks/<script>.py`` has ``benchmarks/`` on ``sys.path``
(Python puts the script's folder there), so it imports these as ``harness.<module>``, and
so do the ranks it launches (they inherit the parent's ``sys.path``).
"""
