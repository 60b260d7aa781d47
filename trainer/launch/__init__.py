"""The launcher: the training processes under accelerate, stop signals, the volume's lease."""
