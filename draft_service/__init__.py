"""The draft service: proposes token blocks with a cheap draft model."""
