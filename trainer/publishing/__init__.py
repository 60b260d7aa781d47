"""The finished model: saved whole on the volume, then copied beyond it (the object-store mirror's final upload, the Hugging Face hub)."""
