"""The pod runtime: everything the chart runs in a pod beside and around the ranks, one package. The chart ships it
in the scripts ConfigMap (files/podruntime/, the source itself: no copy exists anywhere), the train package and the
glue import it like any other, and so do the tests. docs/pod-runtime.md says where each part of the life cycle
lives.

  protocol     the words, files, records and exit statuses the ranks and the pod programs exchange (both sides)
  tenantfiles  the one set of rules for reading and writing what a tenant's program can write
  checkpoints  which checkpoints are complete; the tag grammar
  causes       the causes and the policy that picks one, as data (the pods' and make why's)
  ledger       the job's attempts, failure budget and stop rules
  loop         the attempt loop; sshmode and nosshmode its two modes; channel the hosts' connection to the
               ledger's owner
  evidence, ranks, watchdog, host   what a host knows, its ranks stopped, hangs found, /proc read
  sidecar, objectstore              the progress sidecar and the bucket
  ranklog      every line a rank writes, tagged
  text         the cleaner, the log helper, the line splitter, the duration formatter
  cli          the programs
"""
