"""The HTTP API (FastAPI app in jobs/api/app.py), its upload limit and Prometheus metrics; it serves the
HTML job report that jobs/domain/report.py builds. It builds on jobs.domain and storage; it imports no
torch, worker or kernels."""
