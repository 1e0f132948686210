"""What an operator runs or scrapes: `status`, `doctor`, the metrics endpoint,
and the demo mode's loop-backed VG."""
