"""Train a Llama-style byte-level decoder in Equinox, in bf16 or NVFP4.

    python examples/text_data.py prepare --out .data/      # once (network)
    python examples/llama_equinox.py --precision nvfp4     # CPU: about a minute

The model and the run are ``nvfp4_examples/llama_equinox.py`` (its docstring
describes both; ``--help`` lists the flags); benchmarks/convergence.py has
the GPU-sized flags.
"""

from nvfp4_examples.llama_equinox import main

if __name__ == "__main__":
    main()
