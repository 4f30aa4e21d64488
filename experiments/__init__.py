"""absl entry points: each a `main(argv)` driven by flags and an ml_collections config."""
