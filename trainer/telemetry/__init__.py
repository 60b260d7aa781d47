"""What the cluster sees of the job: the Kubeflow TrainJob status, the Prometheus endpoint, the stuck signal."""
