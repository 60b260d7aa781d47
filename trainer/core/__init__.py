"""The contract read before torch: settings, the configuration handed over, errors and exit codes, the platform and cluster, the volume, the ranks."""
