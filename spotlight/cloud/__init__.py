"""Stand-ins for what this machine cannot have: a mock cloud metadata server speaking the real
AWS / GCP / Azure formats (docs/preemption-notices.md)."""
