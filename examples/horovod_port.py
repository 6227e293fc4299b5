"""Horovod Elastic's PyTorch MNIST example, ported line by line to peer-elastic.

The original is ``horovod/examples/elastic/pytorch/pytorch_mnist_elastic.py``. This port keeps
its structure, names and order, so the two can be read side by side; every line that changed
carries a ``# horovod: <original> -> <replacement>`` comment. Two things differ on purpose:

* the data is scikit-learn's 8x8 digits (bundled with scikit-learn, nothing is downloaded)
  instead of torchvision's MNIST, so the network's shapes are scaled down;
* the training sampler is an ``ElasticSampler`` held in the state (as in Horovod's newer
  elastic examples), so after a reset no sample of the epoch is skipped or repeated.

Run it on two peers with an embedded etcd (instead of ``horovodrun -np 2 --min-np 1
--host-discovery-script ...``):

    peer-elastic run --standalone -n 2 --min-np 1 -- python examples/horovod_port.py

Extra peers can join at any time with the same ``PEER_ELASTIC_ETCD`` / ``PEER_ELASTIC_JOB``.
"""

# The original's style (super(Net, self), str.format) is kept so the two read alike.
# ruff: noqa: UP008, UP032

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from torch.utils.data import TensorDataset

import peer_elastic as pe  # horovod: import horovod.torch as hvd -> import peer_elastic as pe

# Training settings
parser = argparse.ArgumentParser(description='PyTorch digits example (Horovod Elastic port)')
parser.add_argument('--batch-size', type=int, default=32, metavar='N',
                    help='input batch size for training (default: 32)')
parser.add_argument('--test-batch-size', type=int, default=1000, metavar='N',
                    help='input batch size for testing (default: 1000)')
parser.add_argument('--epochs', type=int, default=10, metavar='N',
                    help='number of epochs to train (default: 10)')
parser.add_argument('--lr', type=float, default=0.1, metavar='LR',
                    help='learning rate per peer (default: 0.1)')
parser.add_argument('--momentum', type=float, default=0.5, metavar='M',
                    help='SGD momentum (default: 0.5)')
parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')
parser.add_argument('--seed', type=int, default=42, metavar='S',
                    help='random seed (default: 42)')
parser.add_argument('--log-interval', type=int, default=10, metavar='N',
                    help='how many batches to wait before logging training status')
# Elastic settings (as in Horovod's elastic cifar10/imagenet examples)
parser.add_argument('--batches-per-commit', type=int, default=4, metavar='N',
                    help='batches between state.commit() calls (default: 4)')
parser.add_argument('--check-rank-epoch', type=int, default=0, metavar='E',
                    help='fault injection: the peer started with PEER_ELASTIC_LOCAL_RANK=0 '
                         'raises in epoch E (default: 0, off)')
# horovod: --fp16-allreduce and --use-adasum have no equivalent: pe.DistributedOptimizer
#          averages gradients in full precision.
# horovod: --data-dir is gone: the digits ship inside scikit-learn.

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

# Horovod: initialize library.
# horovod: hvd.init() -> `with pe.join() as peer:` below, around train(state) and test().
# Joining does not give a rank or size: those belong to a generation, which exists only
# inside the elastic run loop, and change at every reset.
torch.manual_seed(args.seed)

# horovod: hvd.local_rank() -> PEER_ELASTIC_LOCAL_RANK, set by `peer-elastic run` (systemd
#          units set it themselves); it is a launch index, never changed by a reset.
local_rank = int(os.environ.get('PEER_ELASTIC_LOCAL_RANK', '0'))

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    torch.cuda.manual_seed(args.seed)


# Horovod: limit # of CPU threads to be used per worker.
torch.set_num_threads(1)


def load_digits_split():
    # horovod: datasets.MNIST(data_dir, train=..., download=True, transform=...) under a
    #          FileLock -> scikit-learn's digits, split once with a fixed seed (every peer
    #          builds the same split).
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    x = (x - 0.3) / 0.4  # transforms.Normalize, with the digits' mean and std
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = perm[:360], perm[360:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


train_dataset, test_dataset = load_digits_split()
# Horovod: use ElasticSampler to partition the training data.
# horovod: hvd.elastic.ElasticSampler(train_dataset) -> pe.ElasticSampler(train_dataset)
train_sampler = pe.ElasticSampler(train_dataset, shuffle=True, seed=args.seed)
train_sampler.set_epoch(1)  # epochs count from 1 here, as in the original
train_loader = torch.utils.data.DataLoader(
    train_dataset, batch_size=args.batch_size, sampler=train_sampler)

# horovod: the test sampler was built here with num_replicas=hvd.size(), rank=hvd.rank();
#          the world is only known inside the join block, so test() builds it.


class Net(nn.Module):
    # Horovod's MNIST net, scaled down for 8x8 images (padding keeps the 2x2 pools valid).
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(80, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 80)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


model = Net()

# horovod: lr_scaler = hvd.size() -> 1 here: the world size is unknown before the first
#          generation forms; on_state_reset scales the learning rate once it has.
lr_scaler = 1

if args.cuda:
    # Move model to GPU.
    model.cuda()

# Horovod: scale learning rate by lr_scaler.
optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler,
                      momentum=args.momentum)

# horovod: compression = hvd.Compression.fp16 / none -> no equivalent.


def metric_average(val, name):
    tensor = torch.tensor(val)
    # horovod: hvd.allreduce(tensor, name=name) (an average) -> a plain torch.distributed
    #          all-reduce over the current generation's group, divided by its size.
    if args.cuda:
        tensor = tensor.cuda()
    torch.distributed.all_reduce(tensor)
    avg_tensor = tensor / torch.distributed.get_world_size()
    return avg_tensor.item()


def check_rank(epoch):
    # Fault injection, as in Horovod's elastic tests: the first launched peer fails in the
    # given epoch. horovod: int(os.environ.get('HOROVOD_RANK')) == 0 ->
    # PEER_ELASTIC_LOCAL_RANK == 0 (an exception that is not a failed collective ends this
    # process; the other peers roll back to their last commit and go on without it).
    if epoch == args.check_rank_epoch and local_rank == 0:
        print('exit rank {}'.format(pe.current_peer().rank), flush=True)
        raise RuntimeError('check_rank and exit')


# horovod: @hvd.elastic.run -> @pe.run
@pe.run
def train(state):
    # post synchronization event (worker added, worker removed) init ...
    # (on_state_reset has already run: peer-elastic calls reset callbacks each time a group
    # forms, the first one included, so the learning rate fits this generation's size.)
    # horovod: for state.epoch in range(state.epoch, args.epochs + 1): ->
    #          a while loop that increments state.epoch at the end of the epoch and commits
    #          it together with the sampler's new epoch (Horovod's end_epoch(state)); a reset
    #          then resumes mid-epoch instead of restarting the epoch.
    while state.epoch <= args.epochs:
        state.model.train()

        # horovod: train_sampler.set_epoch(state.epoch) at the top of the epoch -> at its
        #          end (see end_epoch): set_epoch forgets which samples were processed.
        # horovod: steps_remaining = len(train_loader) - state.batch and the early `break`
        #          -> not needed: after a reset the ElasticSampler yields only the samples
        #          not processed yet, so len(train_loader) is what remains.
        batch_offset = state.batch

        for batch_idx, (data, target) in enumerate(train_loader):
            # horovod: for state.batch, (data, target) in enumerate(train_loader) ->
            #          batch_idx counts from 0 again after each reset; state.batch (set
            #          below) counts the epoch's finished batches across resets.
            check_rank(state.epoch)

            if args.cuda:
                data, target = data.cuda(), target.cuda()
            state.optimizer.zero_grad()
            output = state.model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            # horovod: hvd.DistributedOptimizer averages here as well (pe.DistributedOptimizer)
            state.optimizer.step()
            # horovod: state.train_sampler.record_batch(batch_idx, batch_size), unchanged;
            #          peer-elastic marks batch batch_idx of EVERY rank's shard as processed.
            state.train_sampler.record_batch(batch_idx, args.batch_size)
            state.batch = batch_offset + batch_idx + 1
            if batch_idx % args.log_interval == 0:
                # Horovod: use train_sampler to determine the number of examples in
                # this worker's partition.
                print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                    state.epoch, batch_idx * len(data), len(train_sampler),
                    100.0 * batch_idx / len(train_loader), loss.item()), flush=True)
            # horovod: state.commit() after every batch -> every --batches-per-commit batches
            if (batch_idx + 1) % args.batches_per_commit == 0:
                state.commit()
        end_epoch(state)


def end_epoch(state):
    # Horovod's end_epoch(state) from its elastic cifar10/imagenet examples.
    state.epoch += 1
    state.batch = 0
    state.train_sampler.set_epoch(state.epoch)
    state.commit()


def test():
    model.eval()
    test_loss = 0.
    test_accuracy = 0.
    # horovod: the module-level test_sampler/test_loader with num_replicas=hvd.size(),
    #          rank=hvd.rank() -> built now, for the generation that finished training.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=peer.size, rank=peer.rank, shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)
    with torch.no_grad():
        for data, target in test_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            # sum up batch loss
            test_loss += F.nll_loss(output, target, reduction='sum').item()
            # get the index of the max log-probability
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum().item()

    # Horovod: use test_sampler to determine the number of examples in
    # this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, 'avg_loss')
    test_accuracy = metric_average(test_accuracy, 'avg_accuracy')

    # Horovod: print output only on first rank.
    # horovod: hvd.rank() -> peer.rank (the rank in the generation that finished)
    if peer.rank == 0:
        print('\nTest set: Average loss: {:.4f}, Accuracy: {:.2f}%\n'.format(
            test_loss, 100. * test_accuracy), flush=True)


# Horovod: wrap optimizer with DistributedOptimizer.
# horovod: hvd.DistributedOptimizer(optimizer, named_parameters=..., compression=..., op=...)
#          -> pe.DistributedOptimizer(optimizer): averages over the current generation's
#          group, so nothing needs rebuilding after a reset.
optimizer = pe.DistributedOptimizer(optimizer)


# adjust learning rate on reset
# horovod: runs after each reset -> runs each time a group forms, the first one included,
#          on every rank (joiners too), once the state is synced.
def on_state_reset():
    for param_group in optimizer.param_groups:
        # horovod: hvd.size() -> pe.current_peer().size (the new generation's world size)
        param_group['lr'] = args.lr * pe.current_peer().size


# horovod: hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=1,
#          batch=0) -> pe.TorchState with the same arguments
state = pe.TorchState(model, optimizer, train_sampler=train_sampler, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
# horovod: hvd.init() happened at the top -> join here; leaving the block leaves the job.
with pe.join() as peer:
    train(state)
    test()
