"""Small real training jobs on the goodput library, each with its job YAML (`goodput submit`)."""
