"""Pictures: timelines, traces and loss curves."""
