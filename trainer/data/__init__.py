"""Data: read every source and row format, mask the loss, check and tokenize once, the demo data."""
