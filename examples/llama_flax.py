"""Train a small Llama-style decoder in Flax NNX with NVFP4 linear layers.

    python examples/text_data.py prepare --out .data/   # once (network)
    python examples/llama_flax.py                       # tiny model, CPU, ~1 min
    python examples/llama_flax.py --precision bf16      # the baseline
    python examples/llama_flax.py --precision nvfp4_no_rht --steps 2000 \\
        --d-model 768 --layers 12 --heads 12 --ffn 2048 --batch 32 --seq-len 512

The model and the run are ``nvfp4_examples/llama_flax.py`` (its docstring
describes both; ``--help`` lists the flags).
"""

from nvfp4_examples.llama_flax import main

if __name__ == "__main__":
    main()
