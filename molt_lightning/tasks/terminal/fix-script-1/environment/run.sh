ehco hello > out.txt
