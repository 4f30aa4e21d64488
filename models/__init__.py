"""Model definitions and checkpoint loading. Models import kvpage; kvpage never imports models."""
