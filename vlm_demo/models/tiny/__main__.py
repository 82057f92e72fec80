"""``python -m vlm_demo.models.tiny OUT_DIR``: build and train the tiny model into OUT_DIR."""

from __future__ import annotations

from vlm_demo.models.tiny.build import main

if __name__ == "__main__":
    main()
