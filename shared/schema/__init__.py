"""Every message on the bus: msgspec Structs, validated on decode. Each module holds one
conversation's messages (its docstring says who sends and who answers); import each name from its
module. A job's own messages (ProfilePoint, ProfileRun, JobStats) are the training library's:
`goodput_train.protocol`.

- `base`: the schema version, ids and a submission's bounds, the cluster's shapes, plain answers
- `jobs`: the jobs stream: submissions, the profiler's claims and verdicts, cancels
- `code`: a job's own code, uploaded to the code store through the user API
- `records`: the executors' records of jobs and the queries they answer
- `api`: the user API (goodput.api.*), each job as a JobStatus
- `estimates`: what the estimator learns (profiles, observations) and keeps
- `rounds`: one scheduling round: facts, models, placement, apply, advance
- `runs`: a run of the rounds: request, checkpoint, lease, steps, status
- `nodes`: node agents and the executor's nodes
- `logs`: what jobs print, stored by their node agents and read through the API
- `decisions`: the rounds' recorded decisions, and the API that explains them
"""
