# Test accuracy against the injected gradient delay tau, one panel per
# learning rate, one line per correction (bench/delay_tolerance.sh writes the
# .dat files and calls this). A diverged run is plotted at 0.
if (!exists("dir")) dir = "out/delay_tolerance"
if (!exists("lrs")) lrs = "0.05 0.02 0.01"
if (!exists("png")) png = "docs/delay_tolerance.png"
set terminal pngcairo size 1500,500 font ",11"
set output png
set multiplot layout 1,words(lrs) title "Momentum 0.9 with every gradient tau steps late: fine-grained MLP (8 layers) on MNIST, one process"
set xlabel "gradient delay tau (steps)"
set ylabel "test accuracy"
set yrange [0:1]
set key bottom left
set grid
corrections = "none sc lwp sc+lwp dc"
do for [lr in lrs] {
  set title sprintf("lr %s (cosine)", lr)
  plot for [i=1:words(corrections)] sprintf("%s/lr%s.dat", dir, lr) using 1:(column(i+1)) \
    with linespoints lw 2 title word(corrections, i)
}
unset multiplot
