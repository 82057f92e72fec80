"""The old command name, kept so ``python -m vlm_demo.gpucheck`` keeps working: see :mod:`vlm_demo.tools.gpucheck`."""

import sys

from vlm_demo.tools.gpucheck import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
