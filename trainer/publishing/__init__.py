"""Copies of the finished model beyond the volume: the object-store mirror's final upload and the Hugging Face hub."""
