"""What the tests and the benches share, in one place: the chart rendered by the real helm (chart), its pods run as
network-namespace hosts (harness, chart_pods), train runs and their rank zygote (train_run, rank_zygote), ports
below the ephemeral range (ports), a real Prometheus (prometheus), a copy of values/ to break (glue_tree), hostile
payloads (payloads), the pods' /dev/shm clean-up (shm), the faults the drills inject (faults), and the pod programs'
command as the pods run them (chart.pod_program). bench/ imports only this package."""
