"""The old command name, kept so ``python -m vlm_demo.triton_serve`` keeps working: see :mod:`vlm_demo.triton.serve`."""

import sys

from vlm_demo.triton.serve import main

if __name__ == "__main__":
    main(sys.argv[1:])
