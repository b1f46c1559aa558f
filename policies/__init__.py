"""The pure scheduling policies: each decides a round from plain data (`policies.base.Policy`)."""
