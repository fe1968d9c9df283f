"""Queue and task names: the vocabulary shared by everything that sends or receives."""

#: Queue names, one per role.
GENERATE, RESULTS, TRAIN, CONTROL = "generate", "results", "train", "control"
QUEUES = (GENERATE, RESULTS, TRAIN, CONTROL)

#: Task names, and the queue each one is routed to.
TASK_GENERATE = "refill.generate"
TASK_RECORD_RESULT = "refill.record_result"
TASK_TRAIN_STEP = "refill.train_step"
TASK_DRIVE_RUN = "refill.drive_run"
ROUTES = {
    TASK_GENERATE: GENERATE,
    TASK_RECORD_RESULT: RESULTS,
    TASK_TRAIN_STEP: TRAIN,
    TASK_DRIVE_RUN: CONTROL,
}
