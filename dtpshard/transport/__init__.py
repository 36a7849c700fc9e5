"""How the devices' partials travel between processes: the one-sided shared-memory exchange
(`shared.py`, ranks on one host) and its choice against the process group's collectives
(`choose.py`). The symmetric-memory design for CUDA is in `symmetric.py`."""
