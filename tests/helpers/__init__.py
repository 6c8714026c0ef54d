"""What the tests share: tiny models, references, runs and readers (see docs/contributing.md)."""
