"""What the job prints: the plan before training, the progress line, the summary line at the end, and the libraries kept quiet."""
