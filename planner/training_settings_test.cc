#include "planner/training_settings.h"

#include "gtest/gtest.h"
#include "planner/model_config.h"

namespace tessera::planner {
namespace {

TEST(TrainingSettingsTest, ASpecThatSetsNothingGetsEveryDefault) {
  const v1::TrainingSettings settings = ResolveTrainingSettings(v1::JobSpec());
  EXPECT_EQ(settings.seed(), kDefaultSeed);
  EXPECT_EQ(settings.init_std(), kDefaultInitStd);
  EXPECT_EQ(settings.adam_beta1(), 0.9);
  EXPECT_EQ(settings.adam_beta2(), 0.95);
  EXPECT_EQ(settings.adam_epsilon(), 1e-8);
  EXPECT_EQ(settings.weight_decay(), 0);
  EXPECT_EQ(settings.grad_clip_norm(), 0);
  EXPECT_EQ(settings.eval_batches(), 20);
}

TEST(TrainingSettingsTest, WhatTheSpecSetsIsKept) {
  v1::JobSpec spec;
  spec.set_seed(7);
  spec.mutable_model()->set_init_std(0.01);
  spec.mutable_optimizer()->set_beta1(0.8);
  spec.mutable_optimizer()->set_beta2(0.99);
  spec.mutable_optimizer()->set_epsilon(1e-6);
  spec.mutable_optimizer()->set_weight_decay(0.1);
  spec.mutable_optimizer()->set_grad_clip_norm(1.5);
  spec.mutable_data()->set_eval_batches(3);
  const v1::TrainingSettings settings = ResolveTrainingSettings(spec);
  EXPECT_EQ(settings.seed(), 7u);
  EXPECT_EQ(settings.init_std(), 0.01);
  EXPECT_EQ(settings.adam_beta1(), 0.8);
  EXPECT_EQ(settings.adam_beta2(), 0.99);
  EXPECT_EQ(settings.adam_epsilon(), 1e-6);
  EXPECT_EQ(settings.weight_decay(), 0.1);
  EXPECT_EQ(settings.grad_clip_norm(), 1.5);
  EXPECT_EQ(settings.eval_batches(), 3);
}

TEST(TrainingSettingsTest, PrecisionDefaultsToBf16OnGpusAndFp32OnCpus) {
  EXPECT_EQ(ResolvePrecision(v1::PRECISION_UNSPECIFIED, /*gpus=*/true), v1::PRECISION_BF16);
  EXPECT_EQ(ResolvePrecision(v1::PRECISION_UNSPECIFIED, /*gpus=*/false), v1::PRECISION_FP32);
  EXPECT_EQ(ResolvePrecision(v1::PRECISION_FP32, /*gpus=*/true), v1::PRECISION_FP32);
  EXPECT_EQ(ResolvePrecision(v1::PRECISION_BF16, /*gpus=*/false), v1::PRECISION_BF16);
}

TEST(TrainingSettingsTest, APlanCarriesSettingsOnlyOnceResolved) {
  v1::LayoutPlan plan;
  EXPECT_FALSE(HasTrainingSettings(plan));
  plan.mutable_settings();  // present but empty, as a plan stored before settings were resolved
  EXPECT_FALSE(HasTrainingSettings(plan));
  *plan.mutable_settings() = ResolveTrainingSettings(v1::JobSpec());
  EXPECT_TRUE(HasTrainingSettings(plan));
}

TEST(TrainingSettingsTest, ASpecWithoutASeedGetsTheDefaultOne) {
  EXPECT_EQ(EffectiveSeed(0), kDefaultSeed);
  EXPECT_EQ(EffectiveSeed(7), 7u);
}

}  // namespace
}  // namespace tessera::planner
