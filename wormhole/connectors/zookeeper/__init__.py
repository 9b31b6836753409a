"""The ``zookeeper`` registry (placeholder until the connector lands)."""
