"""What the engine refuses to do on behalf of whoever can write to its database, and its keys."""
