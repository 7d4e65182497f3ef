"""``python -m adaptiveload ...`` -- the same as the ``adaptiveload`` console script (use it under torchrun)."""
from adaptiveload.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
