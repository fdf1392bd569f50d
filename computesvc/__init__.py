"""The compute service: model runner, sampling, scheduler and gRPC servicer."""
