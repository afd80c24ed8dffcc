// objective.c: the choice of an objective's table and what every objective shares
// (train/objective.h).
#include "train/objective.h"

#include <string.h>

const ObjectiveOps *objective_of(TrainType train_type) {
    switch (train_type) {
    case TRAIN_SEQ:
    case TRAIN_SFT:
        return &OBJECTIVE_LM;
    case TRAIN_DPO:
    case TRAIN_GRPO:
    case TRAIN_ONLINE_DPO:
    case TRAIN_ONLINE_GRPO:
        return &OBJECTIVE_PREF;
    case TRAIN_UNSET:
        break;
    }
    return NULL;
}

int objective_open(Objective *o, const ObjectiveOps *ops, const ObjectiveSetup *s, Err *err) {
    memset(o, 0, sizeof *o);
    if (!ops) return err_set(err, "train_type %s: no objective trains it", s->spec->train_type);
    o->ops = ops;
    return ops->open(o, s, err);
}

void objective_close(Objective *o) {
    if (o->ops) o->ops->close(o);
    memset(o, 0, sizeof *o);
}

int objective_n_metrics(const Objective *o) {
    int n = 0;
    while (o->metrics && o->metrics[n])
        n++;
    return n;
}
