"""Put on PYTHONPATH by the benchmark (see sitecustomize.py); never imported as a package."""
