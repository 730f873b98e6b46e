"""The replica role: a snapshot follower that serves the learner's snapshots."""
