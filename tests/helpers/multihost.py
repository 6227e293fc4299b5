"""The settings of a job whose peers run on several hosts (tests/test_multihost.py); the
real-Slurm test (tests/test_deploy_slurm.py) runs its job with them too."""

SETTINGS = {
    "PEER_ELASTIC_LEASE_TTL": 3,
    "PEER_ELASTIC_JOIN_TIMEOUT": 1.5,
    "PEER_ELASTIC_START_SETTLE": 1.0,
    "PEER_ELASTIC_COLLECTIVE_TIMEOUT": 30,
    "PEER_ELASTIC_MIN_NP": 2,
    "PEER_ELASTIC_LOG_LEVEL": "INFO",
    "WORKER_EPOCHS": 400,  # far more than a test trains: each ends through WORKER_END_FILE
    "WORKER_SAMPLES": 480,
    "WORKER_STEP_S": 0.03,
}
