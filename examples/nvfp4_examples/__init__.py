"""The examples' shared code, importable by name.

``llama_flax`` and ``llama_equinox`` (the example Llama models, their flags
and training runs), ``moe_routing`` (top-k routing of their
mixture-of-experts blocks), ``train_common`` (flags, batches, the training
loop and its report) and ``text_data`` (the GCIDE corpus). The scripts in
``examples/`` import it as ``nvfp4_examples`` because Python puts a script's
own folder on the path; the tests have ``examples/`` on theirs through
pyproject.toml's pytest ``pythonpath`` and the benchmarks through
``benchmarks/common.py``.
"""
