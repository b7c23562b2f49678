"""Prepare or inspect the examples' byte-level English corpus (GCIDE).

    python examples/text_data.py prepare --out .data/    # needs apt-get or a .deb
    python examples/text_data.py info .data/corpus.bin

The source, its license and the file format are described in
``nvfp4_examples/text_data.py``.
"""

import sys

from nvfp4_examples.text_data import main

if __name__ == "__main__":
    sys.exit(main())
