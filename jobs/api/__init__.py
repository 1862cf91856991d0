"""The HTTP API (FastAPI app in jobs/api/app.py), its upload limit, Prometheus metrics and the HTML job
report. It builds on jobs.domain and storage; it imports no torch, worker or kernels."""
