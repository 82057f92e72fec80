"""``python -m vlm_demo.models.tiny OUT_DIR``."""

from vlm_demo.models.tiny.data import main

main()
