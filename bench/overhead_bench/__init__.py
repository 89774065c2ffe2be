"""bench/overhead.py in parts: servers, wire, workload, run, figures, goals, report, cli."""
