"""Tasks and agent programs shipped with the package (the embedded default: arithmetic with a calculator)."""
