// What of a rank's reports goes to TensorBoard, under which tags: the step metrics as train/*
// (their step time breakdown as breakdown/*_seconds and breakdown/collective/<kind>_<dim>_seconds),
// evaluations as eval/*, checkpoint writes as checkpoint/*, and the job's spec and plan as text.
#pragma once

#include "tessera/v1/trainer.pb.h"
#include "trainer/report/tensorboard_writer.h"

namespace tessera::trainer {

// Adds the scalars of `report` (step metrics, evaluation, checkpoint) to `writer`; other reports
// add nothing.
void WriteToTensorBoard(const v1::TrainerReport& report, TensorBoardWriter& writer);

// The task's spec and plan as text summaries at `step` (the step the attempt starts from).
void WriteTaskText(const v1::TrainerTask& task, int64_t step, TensorBoardWriter& writer);

}  // namespace tessera::trainer
